"""What the server does beyond the engine: where it listens, who may call it, what it caps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """Safe by default: loopback only, no CORS, no runtime adapter loading, bounded requests.

    ``lora_modules``: (name, path) pairs served as models of their own. ``lora_root``: with
    ``enable_lora_loading``, ``/v1/load_lora_adapter`` loads adapters from under it only.
    ``max_queued_requests``: sequences that may wait beyond the engine's ``max_num_seqs``;
    past that, requests get 503 at once. The other ``max_*`` cap one request (413 for the
    body, 400 for the rest); ``max_tokens=None`` caps at the model's length.
    """

    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora_loading: bool = False
    lora_root: str | None = None
    max_queued_requests: int = 1024
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_n: int = 16
    max_logprobs: int = 20
    max_questions: int = 256
    cors_origins: tuple[str, ...] = ()
    graceful_timeout: float = 30.0
    log_level: str = "warning"
    # The audit log (detlora.audit): a directory, whether it keeps hashes only, and the size
    # at which it starts its next file.
    audit_log: str | None = None
    audit_log_hash_only: bool = False
    audit_log_max_bytes: int = 256 << 20
    api_server_count: int = 1  # front-end processes over the one engine (front_ends.py)

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_request_bytes", "max_n", "max_logprobs",
                     "max_questions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or \
                not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535] (0: a free one), got "
                             f"{self.port!r}")
        if self.enable_lora_loading and not self.lora_root:
            raise ValueError("runtime adapter loading needs --lora-root: adapters load only "
                             "from under it")
        if isinstance(self.api_server_count, bool) or not isinstance(self.api_server_count,
                                                                     int) \
                or not 1 <= self.api_server_count <= 64:
            raise ValueError(f"api_server_count must be an int in [1, 64], got "
                             f"{self.api_server_count!r}")
        if self.api_server_count > 1 and self.audit_log is not None:
            raise ValueError("the audit log needs one front end (--api-server-count 1): it is "
                             "written by the process that answers")
        if self.api_server_count > 1 and self.enable_lora_loading:
            raise ValueError("runtime adapter loading needs one front end "
                             "(--api-server-count 1): an adapter loaded through one front end "
                             "would be unknown to the others")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        if self.audit_log_hash_only and self.audit_log is None:
            raise ValueError("--audit-log-hash-only needs --audit-log DIR")


__all__ = ["ServerConfig"]
