import sys

from otel_llm.cli.main import main

sys.exit(main())
