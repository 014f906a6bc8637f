"""Between vLLM's processes: Unix sockets in the serve's folder, written by the engine cores through
one bounded non-blocking writer and read in the process that faces clients (the stream channel
of frames, the cause channel of JSON lines)."""
