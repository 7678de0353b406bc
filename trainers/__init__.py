"""TRL integration (rollout function adapter, trainer callback); built on `rollout` and `spec`."""
