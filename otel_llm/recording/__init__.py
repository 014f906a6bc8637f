"""Recording observations: the recorder interface, its in-process and SDK implementations,
histogram cells and the Views built from the metric table."""
