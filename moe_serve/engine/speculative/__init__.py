"""Expert-aware speculative decoding: draft, verify in one target pass, keep what the target would.

loop.py is the one draft/verify/accept loop; self_spec.py (SS-MoE: the target drafts with its top-r
experts) and draft_spec.py (SP-MoE: an external dense draft whose attention outputs predict the
target's experts) only choose who drafts and who predicts which experts to prefetch.
"""
