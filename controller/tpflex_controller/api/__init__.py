"""The controller's REST API (FastAPI): ``create_app(ApiDeps(...))``; see docs/api.md."""

from tpflex_controller.api.app import create_app
from tpflex_controller.api.deps import ApiDeps, TokenConfig, TokenFileError, load_tokens

__all__ = ["ApiDeps", "TokenConfig", "TokenFileError", "create_app", "load_tokens"]
