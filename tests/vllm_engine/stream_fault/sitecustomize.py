"""A fault no real engine core makes: a frame of the engine-core stream that fails to translate.
Put this folder on PYTHONPATH with OTEL_LLM_TEST_FAIL_OUTPUTS=N in a serve's environment: in the
process that consumes the stream, translating the Nth frame that holds request outputs raises
TypeError (what a field of an unforeseen type would raise deep in the translation). Everything
else is the real path: the tap, the channel, the consumer's containment.

Loaded as ``sitecustomize`` by every process of the serve; only the consumer's translator calls it.
"""

import os

_FAIL_AT = int(os.environ.get("OTEL_LLM_TEST_FAIL_OUTPUTS", "0"))

if _FAIL_AT > 0:
    from otel_llm.integrations.vllm.translation.stream_translate import StreamTranslator

    _outputs = StreamTranslator.outputs
    _seen = [0]

    def outputs(self, eco):
        if eco.outputs:
            _seen[0] += 1
            if _seen[0] == _FAIL_AT:
                raise TypeError("a fault injected by the test: this frame does not translate")
        return _outputs(self, eco)

    StreamTranslator.outputs = outputs
