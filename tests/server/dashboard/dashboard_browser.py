"""Helpers for the browser tests: screenshots as artifacts and a WCAG contrast check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture then skips each test (fails them under CI=true)
    if os.environ.get("CI", "").lower() == "true":
        raise
    expect = None  # type: ignore[assignment]

__all__ = ["ARTIFACTS", "assert_contrast", "expect", "shoot"]

ARTIFACTS = Path(__file__).resolve().parents[3] / "artifacts" / "dashboard"


def shoot(page: Any, name: str) -> Path:
    """Save a full-page screenshot as a test artifact."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


# Every visible text node's colour against the background it is painted on (alpha composited),
# held to WCAG AA: 4.5:1, or 3:1 for large text. Disabled controls are exempt, as WCAG says.
CONTRAST_JS = """
() => {
  const parse = (c) => {
    const m = c.match(/rgba?\\(([^)]+)\\)/);
    if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return { r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1 };
  };
  const over = (top, base) => ({
    r: top.r * top.a + base.r * (1 - top.a), g: top.g * top.a + base.g * (1 - top.a),
    b: top.b * top.a + base.b * (1 - top.a), a: 1,
  });
  const lum = ({ r, g, b }) => {
    const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c.a > 0) { layers.push(c); if (c.a >= 1) break; }
    }
    let bg = { r: 255, g: 255, b: 255, a: 1 };
    for (const layer of layers.reverse()) bg = over(layer, bg);
    return bg;
  };
  const failures = [];
  const seen = new Set();
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode;
    const el = node.parentElement;
    if (!node.nodeValue.trim() || !el || seen.has(el)) continue;
    seen.add(el);
    if (el.closest(".sr-only, [hidden], svg, dialog:not([open]), :disabled, .skip-link")) continue;
    const rect = el.getBoundingClientRect();
    const cs = getComputedStyle(el);
    if (!rect.width || !rect.height || cs.visibility === "hidden") continue;
    const bg = background(el);
    const fg = over(parse(cs.color), bg);
    const [hi, lo] = [lum(fg), lum(bg)].sort((a, b) => b - a);
    const ratio = (hi + 0.05) / (lo + 0.05);
    const size = parseFloat(cs.fontSize);
    const large = size >= 24 || (parseInt(cs.fontWeight, 10) >= 700 && size >= 18.66);
    if (ratio < (large ? 3 : 4.5) - 0.01) {
      failures.push({ text: node.nodeValue.trim().slice(0, 40), ratio: Math.round(ratio * 100) / 100,
        color: cs.color, background: `rgb(${Math.round(bg.r)}, ${Math.round(bg.g)}, ${Math.round(bg.b)})`,
        element: el.tagName.toLowerCase() + (el.className && typeof el.className === "string" ? "." + el.className.split(" ").join(".") : "") });
    }
  }
  return failures;
}
"""


def assert_contrast(page: Any) -> None:
    failures = page.evaluate(CONTRAST_JS)
    assert not failures, f"text below WCAG AA contrast: {failures[:8]}"
