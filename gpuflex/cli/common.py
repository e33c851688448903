"""What every command shares: the context object, error handling, output helpers."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from typing import Any, Callable

import typer
from rich.console import Console
from rich.markup import escape

from gpuflex.config import Config, load_config
from gpuflex.errors import GpuflexError

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


@dataclasses.dataclass
class Context:
    config_path: str | None = None
    _config: Config | None = None
    _service: Any = None

    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.config_path)
        return self._config

    def service(self):
        if self._service is None:
            from gpuflex.control.service import JobService

            self._service = JobService(self.config())
        return self._service

    def close(self) -> None:
        if self._service is not None:
            self._service.close()


def command(fn: Callable) -> Callable:
    """Turn gpuflex errors into one clean line and an exit code (2 bad input, 1 failed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = kwargs.get("ctx")
        try:
            return fn(*args, **kwargs)
        except GpuflexError as e:
            # escape: messages quote user values and name TOML tables ("[database] url")
            err_console.print(f"[red]error:[/red] {escape(str(e))}", markup=True)
            raise typer.Exit(e.exit_code) from None
        finally:
            if ctx is not None and isinstance(ctx.obj, Context):
                ctx.obj.close()

    return wrapper


def obj(ctx: typer.Context) -> Context:
    return ctx.obj if isinstance(ctx.obj, Context) else Context()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
