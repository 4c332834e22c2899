"""The actors beside the engines: ``policy`` (the trainer), ``critic``, ``reference`` and ``reward`` (scorer).

``api`` states each role's actor interface as the driver calls it; ``base`` is the one FSDP worker the policy and
the critic build on; ``batches`` holds the padded-batch helpers and the token log-probabilities they all share.
"""
