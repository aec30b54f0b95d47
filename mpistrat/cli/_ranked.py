"""A click command run by every rank of a job: only rank 0 prints usage errors."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["RankedCommand"]


def _launcher_rank() -> int | None:
    """This process's rank as the launcher announced it (None outside a launcher); no MPI."""
    # here, not at the top: only this command needs it (start-up time)
    from ..launch.env import detect

    return detect().rank


class RankedCommand(click.Command):
    """Every rank parses the same options and so fails alike: ranks other than 0 exit with
    the same status without printing the error again."""

    @staticmethod
    def _quiet(exc: click.ClickException) -> None:
        if _launcher_rank() not in (None, 0):
            raise click.exceptions.Exit(exc.exit_code) from None

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.ClickException as exc:
            self._quiet(exc)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            self._quiet(exc)
            raise
