"""``python -m otel_llm``: the ``otel-llm`` command (``python -m otel_llm doctor``)."""

import sys

from otel_llm.cli.main import main

sys.exit(main())
