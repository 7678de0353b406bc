"""`SpecConfig`: the speculative config, built from the same JSON a user passes to vLLM's `--speculative-config`.

Key names follow vLLM where the concept is the same, so one dict drives the embedded engine and vLLM. Each key's check
and the engines that honour it are defined once, in spec/config_keys.py (docs/config.md's table).
"""

import dataclasses
import json
import os
from dataclasses import dataclass, field

from spec.config_keys import (DRAFT_SAMPLE_METHODS, EMBEDDED, EMBEDDED_METHODS, KEYS, PROTOCOL_METHODS,
                              REJECTION_SAMPLE_METHODS, VLLM, VLLM_ONLY_METHODS, VLLM_PROJECT, check_keys,
                              check_prompt_lookup, unhonoured)
from spec.schedule import BatchSizeSchedule

__all__ = ["DRAFT_SAMPLE_METHODS", "EMBEDDED_METHODS", "PROTOCOL_METHODS", "REJECTION_SAMPLE_METHODS", "SpecConfig",
           "VLLM_ONLY_METHODS"]


@dataclass
class SpecConfig:
    """Speculative decoding settings.

    method: drafter; the embedded engine runs `draft_model`, `ngram`, `suffix`, `history` (suffix decoding over each
        prompt's earlier rollouts, its live siblings and a global cache: spec/proposers/suffix.py), `custom_class`;
        the vLLM-only methods (`eagle`, `eagle3`, `mtp`, `dflash`, `dspark`, ...) are accepted here for the vLLM
        backend.
    model: draft model path (`draft_model`, vLLM's drafter methods) or "pkg.module.Class" (`custom_class`).
    num_speculative_tokens: the most draft tokens per request per step (K), >= 1.
    num_speculative_tokens_per_batch_size: [[range_start, range_end, K], ...]; K by live batch size
        (spec/schedule.py has the rules); None: always num_speculative_tokens.
    enable_adaptive_verification: each step, verify per request only the drafts whose calibrated survival pays
        for their verification time (spec/adaptive/policy.py); K (or the schedule's K) is the cap. Embedded engine:
        every drafter, with point proposals (greedy draft sampling); vLLM: this project's drafters (`history`,
        `custom_class`) through the same policy in vLLM's workers, and vLLM's own methods where
        the installed vLLM runs its own adaptive verification for them (to_vllm).
    enable_measured_guard: draft at a batch size only where steps with drafts have emitted tokens faster than steps
        without (in a call's drain: brought its end closer faster), as measured on this engine, probing steps without
        drafts now and then (spec/measured_guard.py):
        speculation that loses on this model and machine turns itself off there. This project's drafting host only
        (the embedded engine, `history` and `custom_class` on vLLM).
    rejection_sample_method: `standard` (lossless; the only one the embedded engine runs), `synthetic`, `block`.
    draft_sample_method: `greedy` (drafts are the draft distribution's argmax) or `probabilistic` (sampled).
    prompt_lookup_min / prompt_lookup_max: n-gram sizes tried by `ngram`, longest first.
    suffix_decoding_max_tree_depth: longest substring the suffix trie indexes (and matches).
    suffix_decoding_max_cached_requests: finished rollouts kept in the global suffix cache (0: none).
    suffix_decoding_max_cached_tokens: tokens kept in that cache (0: none), oldest rollouts evicted first; both
        bounds apply. This project's suffix drafters only (the embedded engine, `history` on vLLM): vLLM's own
        suffix cache has no token bound, and to_vllm refuses a non-default value.
    suffix_decoding_max_spec_factor: drafts per request at most this factor x the match length (>= 0, as in vLLM).
    history_max_rollouts_per_prompt: `history`: a prompt's latest rollouts kept as drafts for its next ones.
    history_max_tokens: `history`: tokens kept over all prompts, least recently used prompts evicted first. Both
        history keys are read wherever `history` runs: the embedded engine and vLLM.
    suffix_decoding_min_token_prob: stop speculating below this continuation frequency.
    draft_tensor_parallel_size, max_model_len, parallel_drafting, use_heterogeneous_vocab: passed to vLLM's own
        drafters; refused elsewhere.

    Every field is checked on construction by its key's check (spec/config_keys.py): type (bools are true/false,
    counts are ints) and range, a ValueError naming the field, the value and the fix. Which engines honour each key:
    spec/config_keys.py and docs/config.md's table; an engine refuses a key it does not honour (check_engine).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    num_speculative_tokens_per_batch_size: list | None = None
    enable_adaptive_verification: bool = False
    enable_measured_guard: bool = False
    rejection_sample_method: str = "standard"
    draft_sample_method: str = "greedy"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    # up to max_tree_depth nodes a token at 87 bytes a trie node (README): at depth 24, at most 0.21 GB
    suffix_decoding_max_cached_tokens: int = 100_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    history_max_rollouts_per_prompt: int = 16
    history_max_tokens: int = 50_000_000  # at 4.4 bytes a stored rollout token (README), 220 MB
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    parallel_drafting: bool = False
    use_heterogeneous_vocab: bool = False
    # K by live batch size, parsed once: the per-batch-size ranges, else num_speculative_tokens at every size
    schedule: BatchSizeSchedule = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        check_keys(**{name: getattr(self, name) for name in self.keys()})
        self._check_model()
        check_prompt_lookup(self.prompt_lookup_min, self.prompt_lookup_max)
        ranges = self.num_speculative_tokens_per_batch_size
        self.schedule = BatchSizeSchedule([[1, 1, self.num_speculative_tokens]] if ranges is None else ranges,
                                          self.num_speculative_tokens)

    def _check_model(self) -> None:
        """The model that the method needs, or none where it drafts without one."""
        if self.method in ("suffix", "history") and self.model:
            raise ValueError(f"model={self.model!r} with method {self.method!r}: suffix decoding drafts without a "
                             "model; drop model")
        if self.method not in ("ngram", "suffix", "history") and not self.model:
            fix = '"pkg.module.Class"' if self.method == "custom_class" else "a path to the draft model"
            raise ValueError(f"model={self.model!r}: method {self.method!r} needs a model; set model to {fix}")

    @classmethod
    def from_dict(cls, config: dict) -> "SpecConfig":
        """Build from a vLLM-style dict; an unknown key is a ValueError listing the valid keys."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config={config!r}: expected a dict like "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(config) - set(cls.keys()))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; valid keys: {cls.keys()}")
        for required in ("method", "num_speculative_tokens"):
            if required not in config:
                raise ValueError(f"speculative_config is missing {required!r}; e.g. "
                                 '{"method": "ngram", "num_speculative_tokens": 4}')
        return cls(**config)

    @staticmethod
    def parse_json(text: str, name: str = "speculative_config") -> dict:
        """The dict in the JSON text of vLLM's --speculative-config; bad JSON is a ValueError showing the fix."""
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}={text!r} is not valid JSON ({e}); e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from e

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    def with_schedule(self, schedule: list | None) -> "SpecConfig":
        """This config with num_speculative_tokens_per_batch_size = schedule (checked as any config is)."""
        return SpecConfig.from_dict({**self.to_dict(), "num_speculative_tokens_per_batch_size": schedule})

    def to_dict(self) -> dict:
        """Every key with its value, as JSON-ready data that from_dict (and vLLM) accepts."""
        return {name: getattr(self, name) for name in self.keys()}

    def check_engine(self, engine: str) -> None:
        """NotImplementedError for a key set away from its default that `engine` (spec/config_keys.py: EMBEDDED,
        VLLM, VLLM_PROJECT) does not honour."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init}
        refusal = unhonoured(self.to_dict(), defaults, engine)
        if refusal:
            raise NotImplementedError(refusal)

    def check_vllm_protocol(self) -> None:
        """NotImplementedError when vLLM cannot run this PROTOCOL_METHODS config through the project's proposer."""
        self.check_engine(VLLM_PROJECT)

    def check_embedded(self) -> None:
        """NotImplementedError when this config needs vLLM rather than the embedded engine."""
        if self.method not in EMBEDDED_METHODS:
            raise NotImplementedError(
                f"method={self.method!r} runs only on vLLM; use RolloutGenerator(..., backend=\"vllm\") "
                f"(pip install '.[vllm]'), or pick one of {list(EMBEDDED_METHODS)} for the embedded engine")
        self.check_engine(EMBEDDED)
        if self.enable_adaptive_verification and self.draft_sample_method == "probabilistic":
            raise NotImplementedError(
                "enable_adaptive_verification=True with draft_sample_method='probabilistic': choosing which sampled "
                "drafts to verify from their own probabilities would bias verification against q; use "
                "draft_sample_method='greedy' (point proposals stay lossless under any choice of drafts)")

    def to_vllm(self) -> dict:
        """The `speculative_config` dict for `vllm.LLM` with one of vLLM's own drafters: method, K, and every key set
        away from its default that vLLM reads for this method (n-gram and suffix sizes are always passed, so both
        engines use the same ones).

        enable_adaptive_verification passes through: whether the installed vLLM runs its own adaptive verification for
        this method is vLLM's to say (its Model Runner V2 does, for DSpark and, with full CUDA graphs, the EAGLE
        family and draft models; the V1 runner, the CPU build's, does not), and the vLLM backend turns its refusal
        into one with the fix. NotImplementedError for what vLLM does not run: suffix decoding with a per-batch-size
        schedule (vLLM's asserts one K), and a key vLLM's own drafters do not honour (check_engine) set away from
        its default; those keys are never passed. The PROTOCOL_METHODS reach vLLM otherwise (check_vllm_protocol).
        """
        if self.method in PROTOCOL_METHODS:
            raise NotImplementedError(f"method={self.method!r} is this project's drafter, not one of vLLM's: vLLM runs "
                                      "it through the project's own drafter classes (rollout/vllm_backend/), "
                                      "not through to_vllm")
        if self.method == "suffix" and self.num_speculative_tokens_per_batch_size is not None:
            raise NotImplementedError(
                "method='suffix' with num_speculative_tokens_per_batch_size on vLLM: vLLM's suffix decoder asserts "
                "one K for every step (vllm/v1/spec_decode/suffix_decoding.py) and fails mid-generate; drop the "
                "schedule (the suffix drafter drafts only where its match is long enough anyway)")
        self.check_engine(VLLM)
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init and VLLM in KEYS[f.name].engines}
        by_method = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"),
                     "suffix": tuple(name for name in defaults if name.startswith("suffix_decoding_"))}
        method_only = {name for names in by_method.values() for name in names}
        config = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        for name, default in defaults.items():
            value = getattr(self, name)
            if name in by_method.get(self.method, ()) or (name not in method_only and value != default):
                config[name] = [list(r) for r in value] if name == "num_speculative_tokens_per_batch_size" else value
        return config
