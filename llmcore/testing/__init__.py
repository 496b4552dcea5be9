"""Test helpers for llmcore plugins.

* :mod:`llmcore.testing.conformance`: the backend conformance kit (registration through
  the entry point, lowering of the tiny nanoGPT and Llama, delegation of the transformer's
  matmuls, parity checked or skipped with a reason, clean failures on bad options), as a
  pytest base class (``BackendConformance``) or plain ``check_*`` functions;
* :mod:`llmcore.testing.equivalence`: eager-PyTorch equivalence of transformed modules;
* :mod:`llmcore.testing.payloads`: the processed bytes of a program's delegates, for
  checks with a backend's own tools.

Importing this package imports nothing heavy; the helpers import torch and ExecuTorch
when called.
"""
