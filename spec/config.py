"""`SpecConfig`: the speculative config, built from the same JSON a user passes to vLLM's `--speculative-config`.

Key names follow vLLM where the concept is the same, so one dict drives the embedded engine and vLLM.
"""

import dataclasses
import json
import os
from dataclasses import dataclass, field

from spec.checks import check_bool, check_int, check_number, check_optional_int
from spec.schedule import BatchSizeSchedule

EMBEDDED_METHODS = ("draft_model", "ngram", "suffix", "history", "custom_class")
# drafters to this project's Proposer protocol (spec/proposers/base.py): vLLM runs them through its custom_class hook
# and the project's proposer class (rollout/vllm_backend/proposer.py), not through to_vllm
PROTOCOL_METHODS = ("history", "custom_class")
VLLM_ONLY_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark", "medusa", "mlp_speculator")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "block")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# read by the embedded engine; never sent to vLLM
EMBEDDED_ONLY_KEYS = ("suffix_decoding_max_cached_tokens", "history_max_rollouts_per_prompt", "history_max_tokens")


@dataclass
class SpecConfig:
    """Speculative decoding settings.

    method: drafter; the embedded engine runs `draft_model`, `ngram`, `suffix`, `history` (suffix decoding over each
        prompt's earlier rollouts, its live siblings and a global cache: spec/proposers/suffix.py), `custom_class`;
        the vLLM-only
        methods (`eagle`, `eagle3`, `mtp`, `dflash`, `dspark`, ...) are accepted here for the vLLM backend.
    model: draft model path (`draft_model`, vLLM's drafter methods) or "pkg.module.Class" (`custom_class`).
    num_speculative_tokens: the most draft tokens per request per step (K), >= 1.
    num_speculative_tokens_per_batch_size: [[range_start, range_end, K], ...]; K by live batch size
        (spec/schedule.py has the rules); None: always num_speculative_tokens.
    enable_adaptive_verification: each step, verify per request only the drafts whose calibrated survival pays
        for their verification time (spec/adaptive/policy.py); K (or the schedule's K) is the cap. Embedded engine:
        every drafter, with point proposals (greedy draft sampling); vLLM: this project's drafters (`history`,
        `custom_class`) through the project's proposer (spec/adaptive/observed.py), and vLLM's own methods where
        the installed vLLM runs its own adaptive verification for them (to_vllm).
    rejection_sample_method: `standard` (lossless; the only one the embedded engine runs), `synthetic`, `block`.
    draft_sample_method: `greedy` (drafts are the draft distribution's argmax) or `probabilistic` (sampled).
    prompt_lookup_min / prompt_lookup_max: n-gram sizes tried by `ngram`, longest first.
    suffix_decoding_max_tree_depth: longest substring the suffix trie indexes (and matches).
    suffix_decoding_max_cached_requests: finished rollouts kept in the global suffix cache (0: none).
    suffix_decoding_max_cached_tokens: tokens kept in that cache (0: none), oldest rollouts evicted first; both
        bounds apply. Embedded engine only (vLLM's cache has no token bound; to_vllm refuses a non-default value).
    suffix_decoding_max_spec_factor: drafts per request at most this factor x the match length.
    history_max_rollouts_per_prompt: `history`: a prompt's latest rollouts kept as drafts for its next ones.
    history_max_tokens: `history`: tokens kept over all prompts, least recently used prompts evicted
        first. Embedded engine only, like the other history key.
    suffix_decoding_min_token_prob: stop speculating below this continuation frequency.
    draft_tensor_parallel_size, max_model_len, parallel_drafting, use_heterogeneous_vocab: passed to vLLM.

    Every field is checked on construction: type (bools are true/false, counts are ints) and range, a ValueError
    naming the field, the value and the fix.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    num_speculative_tokens_per_batch_size: list | None = None
    enable_adaptive_verification: bool = False
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
        self._check_choice("method", EMBEDDED_METHODS + VLLM_ONLY_METHODS)
        self._check_choice("rejection_sample_method", REJECTION_SAMPLE_METHODS)
        self._check_choice("draft_sample_method", DRAFT_SAMPLE_METHODS)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                  hint="; to turn speculation off at some batch sizes use num_speculative_tokens_per_batch_size "
                       "with K=0, or pass no speculative config at all")
        self._check_model()
        for name in ("enable_adaptive_verification", "parallel_drafting", "use_heterogeneous_vocab"):
            check_bool(name, getattr(self, name))
        check_optional_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1)
        check_optional_int("max_model_len", self.max_model_len, 1, hint=" (None: the target's)")
        self._check_prompt_lookup()
        self._check_suffix()
        ranges = self.num_speculative_tokens_per_batch_size or [[1, 1, self.num_speculative_tokens]]
        self.schedule = BatchSizeSchedule(ranges, self.num_speculative_tokens)

    def _check_choice(self, name: str, choices: tuple) -> None:
        value = getattr(self, name)
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name}={value!r} is not supported; choose one of {list(choices)}")

    def _check_model(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model={self.model!r}: must be a path (str) or \"pkg.module.Class\" (custom_class)")
        if self.method in ("suffix", "history") and self.model:
            raise ValueError(f"model={self.model!r} with method {self.method!r}: suffix decoding drafts without a "
                             "model; drop model")
        if self.method not in ("ngram", "suffix", "history") and not self.model:
            fix = '"pkg.module.Class"' if self.method == "custom_class" else "a path to the draft model"
            raise ValueError(f"model={self.model!r}: method {self.method!r} needs a model; set model to {fix}")

    def _check_prompt_lookup(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            check_int(name, getattr(self, name), 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} > prompt_lookup_max="
                             f"{self.prompt_lookup_max}: set prompt_lookup_min <= prompt_lookup_max")

    def _check_suffix(self) -> None:
        check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 2)
        check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0,
                  hint=" (0 disables the global cache)")
        check_int("suffix_decoding_max_cached_tokens", self.suffix_decoding_max_cached_tokens, 0,
                  hint=" (0 disables the global cache)")
        check_number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, "> 0",
                     lambda factor: factor > 0)
        check_number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, "in [0, 1]",
                     lambda prob: 0 <= prob <= 1)
        check_int("history_max_rollouts_per_prompt", self.history_max_rollouts_per_prompt, 0,
                  hint=" (a prompt's latest rollouts kept as drafts; 0 keeps none)")
        check_int("history_max_tokens", self.history_max_tokens, 0,
                  hint=" (tokens of history kept over all prompts; 0 keeps none)")

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

    def check_vllm_protocol(self) -> None:
        """NotImplementedError when vLLM cannot run this PROTOCOL_METHODS config through the project's proposer."""
        if self.draft_sample_method != "greedy":
            raise NotImplementedError(f"draft_sample_method={self.draft_sample_method!r} with method={self.method!r} "
                                      "on vLLM: vLLM verifies a custom_class drafter's drafts as point proposals; "
                                      "use draft_sample_method='greedy'")

    def check_embedded(self) -> None:
        """NotImplementedError when this config needs vLLM rather than the embedded engine."""
        if self.method not in EMBEDDED_METHODS:
            raise NotImplementedError(
                f"method={self.method!r} runs only on vLLM; use RolloutGenerator(..., backend=\"vllm\") "
                f"(pip install '.[vllm]'), or pick one of {list(EMBEDDED_METHODS)} for the embedded engine")
        vllm_only = {"parallel_drafting": self.parallel_drafting,
                     "use_heterogeneous_vocab": self.use_heterogeneous_vocab,
                     "draft_tensor_parallel_size": (self.draft_tensor_parallel_size or 1) > 1}
        for name, is_set in vllm_only.items():
            if is_set:
                raise NotImplementedError(f"{name}={getattr(self, name)!r} runs only on vLLM; unset it for the "
                                          "embedded engine or use backend=\"vllm\"")
        if self.enable_adaptive_verification and self.draft_sample_method == "probabilistic":
            raise NotImplementedError(
                "enable_adaptive_verification=True with draft_sample_method='probabilistic': choosing which sampled "
                "drafts to verify from their own probabilities would bias verification against q; use "
                "draft_sample_method='greedy' (point proposals stay lossless under any choice of drafts)")
        if self.rejection_sample_method != "standard":
            raise NotImplementedError(
                f"rejection_sample_method={self.rejection_sample_method!r} runs only on vLLM; the embedded "
                "engine verifies losslessly with 'standard' (use backend=\"vllm\" for the others)")

    def to_vllm(self) -> dict:
        """The `speculative_config` dict for `vllm.LLM` with one of vLLM's own drafters: method, K, and every key set
        away from its default that vLLM reads for this method (n-gram and suffix sizes are always passed, so both
        engines use the same ones).

        enable_adaptive_verification passes through: whether the installed vLLM runs its own adaptive verification for
        this method is vLLM's to say (its Model Runner V2 does, for DSpark and, with full CUDA graphs, the EAGLE
        family and draft models; the V1 runner, the CPU build's, does not), and the vLLM backend turns its refusal
        into one with the fix. NotImplementedError for what vLLM does not run: suffix decoding with a per-batch-size
        schedule (vLLM's asserts one K), and an embedded-only key (EMBEDDED_ONLY_KEYS) set away from its default;
        those keys are never passed. The PROTOCOL_METHODS reach vLLM
        otherwise (check_vllm_protocol).
        """
        if self.method in PROTOCOL_METHODS:
            raise NotImplementedError(f"method={self.method!r} is this project's drafter, not one of vLLM's: vLLM runs "
                                      "it through the project's custom_class proposer (rollout/vllm_backend/), not "
                                      "through to_vllm")
        if self.method == "suffix" and self.num_speculative_tokens_per_batch_size is not None:
            raise NotImplementedError(
                "method='suffix' with num_speculative_tokens_per_batch_size on vLLM: vLLM's suffix decoder asserts "
                "one K for every step (vllm/v1/spec_decode/suffix_decoding.py) and fails mid-generate; drop the "
                "schedule (the suffix drafter drafts only where its match is long enough anyway)")
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init}
        for name in EMBEDDED_ONLY_KEYS:
            if getattr(self, name) != defaults.pop(name):
                raise NotImplementedError(f"{name}={getattr(self, name)!r} is read by the embedded engine only; "
                                          "drop it for backend=\"vllm\" (vLLM bounds its suffix cache by "
                                          "suffix_decoding_max_cached_requests)")
        by_method = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"),
                     "suffix": tuple(name for name in defaults if name.startswith("suffix_decoding_"))}
        method_only = {name for names in by_method.values() for name in names}
        config = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        for name, default in defaults.items():
            value = getattr(self, name)
            if name in by_method.get(self.method, ()) or (name not in method_only and value != default):
                config[name] = [list(r) for r in value] if name == "num_speculative_tokens_per_batch_size" else value
        return config

