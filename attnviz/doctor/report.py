"""The doctor's report: a :class:`Check` a line (PASS, FAIL or SKIP with what it measured, its limit and why; TIME for
a speed, never a verdict) and the :class:`Report` of them all, as text or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Check:
    name: str
    status: str  # "PASS" | "FAIL" | "SKIP" for correctness; "TIME" for a speed report (never a verdict)
    measured: float | None = None
    limit: float | None = None
    detail: str = ""
    ratio: float | None = None  # speed checks
    compared: str = ""  # what was compared with what
    why: str = ""  # why the limit is what it is

    @classmethod
    def against(cls, name: str, measured: float, limit: float, **more) -> "Check":
        """PASS when ``measured`` is within ``limit`` (NaN is not), else FAIL."""
        return cls(name, "PASS" if measured <= limit else "FAIL", measured, limit, **more)

    @classmethod
    def timed(cls, name: str, ratio: float, expected: float, **more) -> "Check":
        """A speed report: ``ratio`` against the ratio attnviz aims for. Its status is TIME whatever the ratio;
        above ``expected`` its detail says "slower than expected" (a machine's speed is not a defect)."""
        slow = not ratio <= expected
        detail = more.pop("detail", "")
        note = f"slower than expected (aimed for at most {expected:g}x)" if slow else f"as expected (at most {expected:g}x)"
        return cls(name, "TIME", ratio, expected, detail=f"{detail} · {note}" if detail else note, ratio=ratio, **more)

    def line(self, say_why: bool = True) -> str:
        """``PASS name: measured … (limit …)``, and under it what was compared and why the limit is what it is."""
        if self.measured is None:
            numbers = ""
        elif self.status == "TIME":
            numbers = f": ratio {self.measured:.3g}"
        else:
            numbers = f": measured {self.measured:.3g} (limit {self.limit:.3g})"
        head = f"{self.status:4} {self.name}{numbers}{' · ' + self.detail if self.detail else ''}"
        label = "expected" if self.status == "TIME" else "limit"  # a timing has no limit: it is never a verdict
        said = "; ".join(part for part in (self.compared, self.why and say_why and f"{label}: {self.why}") if part)
        return head + (f"\n       {said}" if said else "")

    def as_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and (v != "" or k == "name")}


@dataclass
class Report:
    environment: dict
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)  # a TIME line is never a verdict

    def as_json(self) -> dict:
        return {"environment": self.environment, "checks": [c.as_json() for c in self.checks], "ok": self.ok}

    def text(self) -> str:
        env = self.environment
        head = [f"attnviz {env['attnviz']} · torch {env['torch']} · transformers {env['transformers']} · "
                f"triton {env['triton'] or 'not installed'} · {env['platform']}",
                "devices: " + "; ".join(f"{d['name']} ({d['free_mb'] or '?'} MB free)" for d in env["devices"]),
                f"model: {env['model']} on {env['device']} in {env['dtype']}"]
        lines, said = [], set()
        for check in self.checks:  # a limit's reason is said once, under the first check it applies to
            lines.append(check.line(say_why=check.why not in said))
            said.add(check.why)
        return "\n".join(head + lines
                         + [f"{'all checks passed' if self.ok else 'FAILED'}: "
                            f"{sum(c.status == 'PASS' for c in self.checks)} passed, "
                            f"{sum(c.status == 'FAIL' for c in self.checks)} failed, "
                            f"{sum(c.status == 'SKIP' for c in self.checks)} skipped, "
                            f"{sum(c.status == 'TIME' for c in self.checks)} timed"])
