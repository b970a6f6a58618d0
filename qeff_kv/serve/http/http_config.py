"""The HTTP section of the serve options (a section of :class:`qeff_kv.serve.config.ServeConfig`): where the server
listens and what its routes accept. Its fields are named as the ``qeff-kv serve`` options of its group."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qeff_kv.errors import RuntimeInputError


@dataclass
class HttpSection:
    host: str = "127.0.0.1"
    port: int = 8000
    #: a bearer token every /v1 and /slots request must carry (``Authorization: Bearer KEY``); None: open
    api_key: str | None = None
    #: request bodies larger than this get a 413 before they are read (None: the default of http/bodies.py)
    max_request_bytes: int | None = None
    #: after SIGTERM: seconds running requests may take to finish before they are stopped with an error
    drain_seconds: float | None = None
    #: folder of slot state files (POST /slots/{id}?action=save|restore); None: slot actions are refused
    state_dir: str | None = None
    #: the largest ``n`` (choices per request) accepted (default: the sequences run at once)
    max_n: int | None = None
    #: browser origins allowed by CORS ("*": any); None: CORS off. A string is read as a comma-separated list
    allowed_origins: list[str] | str | None = None
    #: vision-language exports: ``image_url`` parts may name local files under this folder (vLLM's
    #: --allowed-local-media-path); None: data: URLs only
    allowed_local_media_path: str | None = None
    #: vision-language exports: the most pixels of one image, read from its header before it is decoded (the
    #: images of a request together: twice that); None: serve/http/images.py's default (50 megapixels)
    max_image_pixels: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.allowed_origins, str):   # "--allowed-origins a,b": the list
            self.allowed_origins = [o.strip() for o in self.allowed_origins.split(",") if o.strip()] \
                if self.allowed_origins else None

    def check(self) -> None:
        """Refuse bad values in one line each. Creates nothing: the state folder is made once the server is about
        to serve."""
        if self.state_dir is not None:
            check_folder_path(Path(self.state_dir))
        if self.api_key is not None:
            check_api_key(self.api_key)
        if not 0 <= self.port <= 65535:
            raise RuntimeInputError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise RuntimeInputError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        if self.max_image_pixels is not None and self.max_image_pixels < 1:
            raise RuntimeInputError(f"--max-image-pixels must be at least 1, got {self.max_image_pixels}")
        if self.drain_seconds is not None and not 0 <= self.drain_seconds <= 3600:
            raise RuntimeInputError(f"--drain-seconds must be in [0, 3600], got {self.drain_seconds}")

    def max_n_for(self, max_sequences: int) -> int:
        """``--max-n`` (default: the sequences run at once), refused above them: n choices run side by side."""
        if self.max_n is None:
            return max_sequences
        if self.max_n > max_sequences:
            raise RuntimeInputError(f"--max-n {self.max_n}: the server runs {max_sequences} sequences at once; "
                                    f"give at most that (or more --max-sequences)")
        return self.max_n


def check_api_key(key: str) -> None:
    """A key a client can send: printable ASCII without leading or trailing spaces (HTTP strips those from the
    header, so such a key could never match)."""
    if not key.strip():
        raise RuntimeInputError("--api-key is empty")
    if key != key.strip() or not key.isascii() or not key.isprintable():
        raise RuntimeInputError("--api-key must be printable ASCII without leading or trailing spaces (an "
                                "Authorization header cannot carry anything else, so it could never match)")


def check_folder_path(d: Path) -> None:
    """``d`` is a folder, or can be created: its nearest existing ancestor is a folder."""
    for part in [d, *d.parents]:
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                where = "" if part == d else f" ({part} is not a folder)"
                raise RuntimeInputError(f"--state-dir {d}: not a folder{where}")
            return
