"""The residual hook points by name (``steerable.hook_points`` has the rest); free of torch, so the
CLI can offer them as choices before it imports anything heavy."""

PRE_ATTN = "pre_attn"  # residual stream entering layer L (HF hidden_states[L])
POST_ATTN = "post_attn"  # residual after the attention residual add
POST_MLP = "post_mlp"  # layer output (HF hidden_states[L + 1], before any final norm)
RESIDUAL_POINTS = (PRE_ATTN, POST_ATTN, POST_MLP)
