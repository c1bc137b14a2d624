"""How bytes move: fd passing over AF_UNIX sockets, connections, flow control, queues."""
