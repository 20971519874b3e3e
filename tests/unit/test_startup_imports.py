"""What a start imports on its way to ready (docs/bench/figures.md, "Start to ready"):
the node's process and the worker's, each in a fresh interpreter, leave out the
packages they do not need then. numpy, gguf and prometheus_client cost the node
~0.45 s of CPU; llama_cpp is loaded by the node only later, for its token counter."""

from __future__ import annotations

import json
import subprocess
import sys

from node.testing import REPO

HEAVY = ("numpy", "gguf", "prometheus_client", "llama_cpp", "node.bench.runner", "asyncio")


def imported_after(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; which of ``HEAVY`` it imported, and what
    ``code`` left in ``out``."""
    script = (
        "import json, sys\nout = {}\n"
        + code
        + f"\nheavy = [m for m in {HEAVY!r} if m in sys.modules]"
        + "\nprint(json.dumps({'heavy': heavy, 'out': out}))"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_node_process_imports_none_of_them_to_start() -> None:
    result = imported_after("import node.cli.main\nimport node.app")
    assert result["heavy"] == ["asyncio"]  # the node's own (Node's async with, clients)


def test_the_model_worker_imports_no_asyncio_and_the_rule_worker_no_model() -> None:
    result = imported_after(
        "import node.worker\n"
        "from node.engine import EngineSpec\n"
        "from node.worker import make_engine\n"
        "make_engine(EngineSpec(kind='rules', model_path='fallback/default_rules.toml',"
        " n_ctx=0, n_batch=0, threads=1))"
    )
    assert result["heavy"] == []


def test_the_quantization_tables_are_ggufs_own_without_importing_gguf() -> None:
    result = imported_after(
        "import node.capacity.plan as plan\n"
        "from node.capacity import gguf as ours\n"
        "out['before'] = [m for m in ('gguf', 'numpy') if m in sys.modules]\n"
        "out['q8_0'] = [int(x) for x in ours.GGML_QUANT_SIZES[ours.GGMLQuantizationType.Q8_0]]\n"
        "out['f16_bytes'] = str(plan.bytes_per_element('f16'))\n"
        "import gguf\n"
        "out['same'] = {int(k): list(v) for k, v in ours.GGML_QUANT_SIZES.items()} == "
        "{int(k): list(v) for k, v in gguf.GGML_QUANT_SIZES.items()}\n"
        "out['types'] = sorted(int(t) for t in ours.GGMLQuantizationType) == "
        "sorted(int(t) for t in gguf.GGMLQuantizationType)"
    )
    out = result["out"]
    assert isinstance(out, dict)
    assert out["before"] == []
    assert out["q8_0"] == [32, 34]
    assert out["f16_bytes"] == "2"
    assert out["same"] is True and out["types"] is True
