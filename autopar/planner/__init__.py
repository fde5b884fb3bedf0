"""The planners: ``intra`` (the intra-op planning passes on one mesh), ``pipelined`` (a mesh with a
pipeline axis, or gradient accumulation), ``factorize`` (a device count: each factorization into
pp x dp x tp planned and compared), all configured by one ``options.PlanOptions``; ``report`` turns
their result into the user's ``Plan``."""
