"""edgenode message bus: wire protocol, sans-I/O broker core, zmq I/O loop, client library."""
