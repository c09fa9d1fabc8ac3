"""The delta rule's fla-core paths with the project's Triton kernels (``impl`` "triton", and "fla"):

- ``dqkwg.py``: our replacement of fla-core's ``chunk_bwd_kernel_dqkwg``, the backward kernel Triton
  3.4 <= v < 3.7.1 miscompiles on Hopper;
- ``kda_intra.py``: our KDA intra-chunk backward (tensor-core diagonal blocks for any gate);
- ``pipeline.py``: fla-core's chunked forward and backward pieces, run in fla's order with those two kernels;
- ``ops.py``: the custom ops ``attnlab::delta_rule_fwd`` / ``delta_rule_bwd`` (:func:`delta_rule_op`) that run
  fla's pipeline ("fla") or ours ("fla_hopper"), opaque to torch.compile.
"""

from __future__ import annotations

from attnlab.attention.ops.delta_rule.triton.ops import delta_rule_op

__all__ = ["delta_rule_op"]
