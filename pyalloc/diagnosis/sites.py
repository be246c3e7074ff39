"""Allocation sites: the first frame of the user's own code on the Python stack.

A frame is the user's when its file is outside torch, site-packages / dist-packages, Python's
standard library and pyalloc itself. The verdict is cached per code object, so attributing an
allocation costs a walk over the frames above it and a dictionary lookup each.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from types import CodeType, FrameType

NO_USER_FRAME = ("<no user frame>", 0, "", "", 0)
MAX_SITES = 8192  # beyond this, new sites are counted together as OVERFLOW_SITE
OVERFLOW_SITE = ("<other sites>", 0, "", "", 0)


def _library_prefixes() -> tuple[str, ...]:
    import torch

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the pyalloc package
    prefixes = {os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, here + os.sep}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            prefixes.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(prefixes))


@dataclass(frozen=True)
class Site:
    """The first user frame, and the user frame that called its function (the training loop's
    line, when the site is in a model's forward); a site is the pair."""

    file: str
    line: int
    function: str
    caller_file: str = ""
    caller_line: int = 0

    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


class SiteTable:
    """Interns sites as small integers; bounded by MAX_SITES."""

    def __init__(self) -> None:
        self._prefixes = _library_prefixes()
        self._user_code: dict[CodeType, bool] = {}
        self._ids: dict[tuple[str, int, str, str, int], int] = {}
        self.sites: list[Site] = []
        self.no_user_frame = self.intern(NO_USER_FRAME)

    def is_user_file(self, filename: str) -> bool:
        if filename.startswith("<frozen") or filename.startswith(self._prefixes):
            return False
        parts = filename.replace("\\", "/").split("/")
        return "site-packages" not in parts and "dist-packages" not in parts

    def _is_user(self, code: CodeType) -> bool:
        verdict = self._user_code.get(code)
        if verdict is None:
            filename = code.co_filename
            if not filename.startswith("<"):
                filename = os.path.abspath(filename)
            verdict = self.is_user_file(filename)
            self._user_code[code] = verdict
        return verdict

    def user_frame(self, frame: FrameType | None) -> FrameType | None:
        while frame is not None and not self._is_user(frame.f_code):
            frame = frame.f_back
        return frame

    def current(self, skip: int = 2) -> int:
        """The site id of the first user frame above the caller's caller."""
        frame = self.user_frame(sys._getframe(skip))
        if frame is None:
            return self.intern(NO_USER_FRAME)
        code = frame.f_code
        caller = self.user_frame(frame.f_back)
        if caller is None:
            return self.intern((code.co_filename, frame.f_lineno, code.co_name, "", 0))
        return self.intern((code.co_filename, frame.f_lineno, code.co_name,
                            caller.f_code.co_filename, caller.f_lineno))

    def intern(self, key: tuple[str, int, str, str, int]) -> int:
        ident = self._ids.get(key)
        if ident is None:
            if len(self.sites) >= MAX_SITES:
                key = OVERFLOW_SITE
                ident = self._ids.get(key)
                if ident is not None:
                    return ident
            ident = len(self.sites)
            self._ids[key] = ident
            self.sites.append(Site(*key))
        return ident

    def __getitem__(self, ident: int) -> Site:
        return self.sites[ident]
