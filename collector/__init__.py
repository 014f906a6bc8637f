"""collector/: the operator-facing configs; ``collector.generate`` builds its dashboards and rules."""
