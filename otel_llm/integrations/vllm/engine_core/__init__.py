"""What runs in each engine-core process: the tap handing the engine core's requests and outputs
to the stream channel, and the preemption causes read at vLLM's scheduler for the cause channel.
Never blocking the busy loop."""
