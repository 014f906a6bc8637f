"""Generates collector/'s Grafana dashboards and Prometheus rules, one of each per naming profile,
from the plugin's metric table (``python -m collector.generate``, or ``make dashboards``).

``profiles`` turns the table into the names Prometheus stores; ``rules`` and ``dashboard`` build the
files from them; ``__main__`` writes them (``--check`` compares instead). The dashboards need the
``dashboards`` extra (grafana-foundation-sdk, the Grafana 11.6 build); the rules need only PyYAML.
"""
