"""Drafters behind one protocol (base.py), and the factory that builds one from a SpecConfig."""

from spec.config import SpecConfig
from spec.proposers.base import DrafterConfigError, DraftRequest, Proposal, Proposer


def build_proposer(config: SpecConfig, *, draft_model=None, max_num_seqs: int, max_model_len: int,
                   device=None, dtype=None) -> Proposer:
    """The drafter the config names, for the embedded engine.

    draft_model: the loaded HF causal LM where the config has one (`config.has_draft_model`: method "draft_model",
    or "history" with a `model`; the caller loads `config.model`).
    """
    config.check_embedded()
    if config.method == "ngram":
        from spec.proposers.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "custom_class":
        from spec.proposers.custom import CustomProposer
        return CustomProposer(config)
    if config.has_draft_model and draft_model is None:
        raise ValueError(f"method={config.method!r} with model={config.model!r} needs the loaded draft model")
    if config.method in ("suffix", "history"):
        suffix = _suffix_proposer(config)
        if not config.has_draft_model:
            return suffix
        from spec.proposers.hybrid import HybridProposer
        return HybridProposer(suffix, _draft_model_proposer(config, draft_model, max_num_seqs, max_model_len, device,
                                                            dtype))
    return _draft_model_proposer(config, draft_model, max_num_seqs, max_model_len, device, dtype)


def _suffix_proposer(config: SpecConfig):
    from spec.proposers.history import HistoryStore
    from spec.proposers.suffix import SuffixProposer
    history = HistoryStore(config.history_max_rollouts_per_prompt, config.history_max_tokens) \
        if config.method == "history" else None
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob,
                          config.suffix_decoding_max_cached_tokens, history=history)


def _draft_model_proposer(config: SpecConfig, draft_model, max_num_seqs: int, max_model_len: int, device, dtype):
    from spec.proposers.draft_model import DraftModelProposer
    return DraftModelProposer(draft_model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              draft_sample_method=config.draft_sample_method, device=device, dtype=dtype)


__all__ = ["DrafterConfigError", "DraftRequest", "Proposal", "Proposer", "build_proposer"]
