"""Drafters behind one protocol (base.py), and the factory that builds one from a SpecConfig."""

from spec.config import SpecConfig
from spec.proposers.base import DrafterConfigError, DraftRequest, Proposal, Proposer


def build_proposer(config: SpecConfig, *, draft_model=None, max_num_seqs: int, max_model_len: int,
                   device=None, dtype=None) -> Proposer:
    """The drafter the config names, for the embedded engine.

    draft_model: the loaded HF causal LM for `method="draft_model"` (the caller loads `config.model`).
    """
    config.check_embedded()
    if config.method == "ngram":
        from spec.proposers.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "custom_class":
        from spec.proposers.custom import CustomProposer
        return CustomProposer(config)
    if config.method in ("suffix", "history"):
        return _suffix_proposer(config)
    if draft_model is None:
        raise ValueError(f"method='draft_model' needs the loaded draft model (model={config.model!r})")
    from spec.proposers.draft_model import DraftModelProposer
    return DraftModelProposer(draft_model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              draft_sample_method=config.draft_sample_method, device=device, dtype=dtype)


def _suffix_proposer(config: SpecConfig):
    from spec.proposers.history import HistoryStore
    from spec.proposers.suffix import SuffixProposer
    history = HistoryStore(config.history_max_rollouts_per_prompt, config.history_max_tokens) \
        if config.method == "history" else None
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob,
                          config.suffix_decoding_max_cached_tokens, history=history)



__all__ = ["DrafterConfigError", "DraftRequest", "Proposal", "Proposer", "build_proposer"]
