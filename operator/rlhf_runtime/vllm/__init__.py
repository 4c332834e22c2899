"""The one place that knows vLLM: version differences (``compat``) and the vLLM plugin (``plugin``)."""
