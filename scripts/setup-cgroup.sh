#!/usr/bin/env bash
# Prepare a delegated cgroup subtree so that edgenode, running as a non-root
# service user, can put each worker in its own cgroup (memory, cpu, cpuset).
#
# With systemd, prefer etc/edgenode.service (Delegate=yes): systemd delegates
# the service's own cgroup and this script is not needed. Use this script on
# hosts without systemd, or on cgroup v1 / hybrid hosts, where systemd does not
# hand the v1 controller hierarchies to unprivileged services.
#
# What it does (idempotent; run it again after a reboot, cgroupfs is not kept):
#   v2 (unified): enables the controllers top-down in each ancestor's
#     cgroup.subtree_control, creates the cgroup, and chowns the directory plus
#     cgroup.procs, cgroup.subtree_control and cgroup.threads to the user - the
#     files Documentation/admin-guide/cgroup-v2.rst ("Delegation") says to grant.
#   v1 / hybrid: creates the same path in the memory, cpu and cpuset
#     hierarchies, copies cpuset.cpus/cpuset.mems down from the parent (a new v1
#     cpuset is empty and nothing can join it, cgroup-v1/cpusets.rst), and
#     chowns the directory plus cgroup.procs and tasks.
set -euo pipefail

readonly CGROUP_FS=/sys/fs/cgroup
readonly CONTROLLERS=(memory cpu cpuset)
PROG=${0##*/}
readonly PROG

usage() {
	cat <<EOF
Usage: $PROG [--path CGROUP] [--remove] [--dry-run] USER[:GROUP]

Create the cgroup CGROUP (default /edgenode.delegated) and delegate it to USER.
Then set, in the node's config:

    [workers]
    cgroup_root = "/edgenode.delegated"

On cgroup v2 the kernel lets a process move only inside a subtree it may write
at the common ancestor, so start the node INSIDE the delegated cgroup, e.g.

    echo \$\$ > $CGROUP_FS/edgenode.delegated/cgroup.procs && exec edgenode start

and leave cgroup_root = "" (the node's own cgroup is then the delegated one).

Options:
  --path CGROUP  cgroup path to create, as /proc/self/cgroup shows paths
  --remove       remove the delegated cgroup again (it must be empty)
  --dry-run      print what would be done, change nothing
  -h, --help     this text
EOF
}

die() {
	printf '%s: %s\n' "$PROG" "$*" >&2
	exit 1
}

DRY_RUN=0
run() {
	if ((DRY_RUN)); then
		printf '+ %s\n' "$*"
	else
		"$@"
	fi
}

# write VALUE FILE: what `echo VALUE > FILE` does, honouring --dry-run.
write() {
	if ((DRY_RUN)); then
		printf '+ echo %q > %q\n' "$1" "$2"
	else
		printf '%s' "$1" >"$2"
	fi
}

# v1_mount CONTROLLER: the mount point of the v1 hierarchy that has CONTROLLER
# (co-mounts such as cpu,cpuacct included), or nothing.
v1_mount() {
	awk -v want="$1" '
		{
			for (i = 1; i <= NF && $i != "-"; i++) {}
			if ($(i + 1) != "cgroup") next
			n = split($(i + 3), opts, ",")
			for (j = 1; j <= n; j++) if (opts[j] == want) { print $5; exit }
		}' /proc/self/mountinfo
}

is_v2() {
	[[ $(stat -f -c %T "$CGROUP_FS") == cgroup2fs ]]
}

setup_v2() {
	local path=$1 owner=$2 dir=$CGROUP_FS part wanted available enabled c
	# Top-down: a cgroup can enable only what its parent enabled for it.
	local -a parts
	IFS=/ read -r -a parts <<<"${path#/}"
	for part in "${parts[@]}"; do
		# (a level that does not exist yet is only possible under --dry-run)
		available=$(cat "$dir/cgroup.controllers" 2>/dev/null || true)
		enabled=$(cat "$dir/cgroup.subtree_control" 2>/dev/null || true)
		wanted=""
		for c in "${CONTROLLERS[@]}"; do
			if [[ " $available " == *" $c "* && " $enabled " != *" $c "* ]]; then
				wanted+="+$c "
			fi
		done
		if [[ -n $wanted ]]; then
			write "${wanted% }" "$dir/cgroup.subtree_control" ||
				die "cannot enable ${wanted% } in $dir (does it hold processes? cgroup v2 allows controllers only in cgroups without processes)"
		fi
		dir+=/$part
		[[ -d $dir ]] || run mkdir "$dir"
	done
	run chown "$owner" "$dir" "$dir/cgroup.procs" "$dir/cgroup.subtree_control" "$dir/cgroup.threads"
	echo "delegated $dir to $owner (cgroup v2)"
}

setup_v1() {
	local path=$1 owner=$2 controller mount dir part parent
	local -a parts
	IFS=/ read -r -a parts <<<"${path#/}"
	for controller in "${CONTROLLERS[@]}"; do
		mount=$(v1_mount "$controller")
		if [[ -z $mount ]]; then
			echo "$PROG: no v1 $controller hierarchy mounted: skipped" >&2
			continue
		fi
		dir=$mount
		for part in "${parts[@]}"; do
			parent=$dir
			dir+=/$part
			[[ -d $dir ]] || run mkdir "$dir"
			if [[ $controller == cpuset ]]; then
				copy_cpuset "$parent" "$dir"
			fi
		done
		run chown "$owner" "$dir" "$dir/cgroup.procs" "$dir/tasks"
		echo "delegated $dir to $owner (cgroup v1 $controller)"
	done
}

copy_cpuset() {
	local parent=$1 dir=$2 file
	for file in cpuset.mems cpuset.cpus; do
		if ((DRY_RUN)) && [[ ! -e $dir/$file ]]; then
			write "<$parent/$file>" "$dir/$file"
		elif [[ -z $(<"$dir/$file") ]]; then
			write "$(<"$parent/$file")" "$dir/$file"
		fi
	done
}

remove() {
	local path=$1 controller mount
	if is_v2; then
		[[ -d $CGROUP_FS$path ]] && run rmdir "$CGROUP_FS$path"
	else
		for controller in "${CONTROLLERS[@]}"; do
			mount=$(v1_mount "$controller")
			if [[ -n $mount && -d $mount$path ]]; then
				run rmdir "$mount$path"
			fi
		done
	fi
	echo "removed $path"
}

main() {
	local path=/edgenode.delegated remove_it=0 owner=""
	while (($#)); do
		case $1 in
		--path)
			(($# >= 2)) || die "--path needs a value"
			path=$2
			shift
			;;
		--remove) remove_it=1 ;;
		--dry-run) DRY_RUN=1 ;;
		-h | --help)
			usage
			exit 0
			;;
		-*) die "unknown option $1 (see --help)" ;;
		*)
			[[ -z $owner ]] || die "only one USER[:GROUP] please"
			owner=$1
			;;
		esac
		shift
	done
	[[ $path == /?* && $path != *..* && $path != *//* ]] ||
		die "--path must be an absolute cgroup path like /edgenode.delegated, not the root"
	path=${path%/}
	if ((remove_it)); then
		((EUID == 0)) || ((DRY_RUN)) || die "must run as root"
		remove "$path"
		return
	fi
	[[ -n $owner ]] || {
		usage >&2
		exit 2
	}
	id -u "${owner%%:*}" >/dev/null 2>&1 || die "no such user: ${owner%%:*}"
	[[ $owner == *:* ]] || owner="$owner:$(id -gn "$owner")"
	((EUID == 0)) || ((DRY_RUN)) || die "must run as root"
	if is_v2; then
		setup_v2 "$path" "$owner"
	elif [[ -d $CGROUP_FS ]]; then
		setup_v1 "$path" "$owner"
	else
		die "no cgroup filesystem at $CGROUP_FS"
	fi
}

main "$@"
