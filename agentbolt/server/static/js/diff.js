// A line diff (longest common subsequence) and its grouping into hunks with context.

const MAX_CELLS = 4_000_000; // beyond this the middle is shown as "replaced" rather than diffed

/**
 * Diff two texts line by line. Returns ops [{op: "same" | "add" | "del", text, a, b}] where
 * ``a`` / ``b`` are 1-based line numbers in the old / new text (null where the line is absent).
 */
export function diffLines(oldText, newText) {
  const lines = (t) => (t === null || t === undefined || t === "" ? [] : String(t).split("\n"));
  const a = lines(oldText);
  const b = lines(newText);
  let start = 0;
  while (start < a.length && start < b.length && a[start] === b[start]) start++;
  let endA = a.length;
  let endB = b.length;
  while (endA > start && endB > start && a[endA - 1] === b[endB - 1]) {
    endA--;
    endB--;
  }
  const ops = [];
  for (let i = 0; i < start; i++) ops.push({ op: "same", text: a[i], a: i + 1, b: i + 1 });
  ops.push(...middle(a, b, start, endA, endB));
  for (let i = 0; i < a.length - endA; i++) {
    ops.push({ op: "same", text: a[endA + i], a: endA + i + 1, b: endB + i + 1 });
  }
  return ops;
}

function middle(a, b, start, endA, endB) {
  const n = endA - start;
  const m = endB - start;
  const out = [];
  if ((n + 1) * (m + 1) > MAX_CELLS) {
    for (let i = 0; i < n; i++) out.push({ op: "del", text: a[start + i], a: start + i + 1, b: null });
    for (let j = 0; j < m; j++) out.push({ op: "add", text: b[start + j], a: null, b: start + j + 1 });
    return out;
  }
  // lcs[i][j] = LCS length of a[start+i..endA) and b[start+j..endB), flattened.
  const w = m + 1;
  const lcs = new Uint32Array((n + 1) * w);
  for (let i = n - 1; i >= 0; i--) {
    for (let j = m - 1; j >= 0; j--) {
      lcs[i * w + j] = a[start + i] === b[start + j]
        ? lcs[(i + 1) * w + j + 1] + 1
        : Math.max(lcs[(i + 1) * w + j], lcs[i * w + j + 1]);
    }
  }
  let i = 0;
  let j = 0;
  while (i < n || j < m) {
    if (i < n && j < m && a[start + i] === b[start + j]) {
      out.push({ op: "same", text: a[start + i], a: start + i + 1, b: start + j + 1 });
      i++;
      j++;
    } else if (i < n && (j === m || lcs[(i + 1) * w + j] >= lcs[i * w + j + 1])) {
      out.push({ op: "del", text: a[start + i], a: start + i + 1, b: null }); // removals first, as in a unified diff
      i++;
    } else {
      out.push({ op: "add", text: b[start + j], a: null, b: start + j + 1 });
      j++;
    }
  }
  return out;
}

/**
 * Collapse long runs of unchanged lines: keeps ``context`` lines around each change and
 * replaces the rest by {op: "skip", count}.
 */
export function withContext(ops, context = 3) {
  const changed = ops.map((o) => o.op !== "same");
  const keep = ops.map((_, i) => {
    for (let k = Math.max(0, i - context); k <= Math.min(ops.length - 1, i + context); k++) {
      if (changed[k]) return true;
    }
    return false;
  });
  const out = [];
  let skipped = 0;
  ops.forEach((o, i) => {
    if (keep[i]) {
      if (skipped) out.push({ op: "skip", count: skipped });
      skipped = 0;
      out.push(o);
    } else {
      skipped++;
    }
  });
  if (skipped) out.push({ op: "skip", count: skipped });
  return out;
}

export function diffStats(ops) {
  return {
    added: ops.filter((o) => o.op === "add").length,
    removed: ops.filter((o) => o.op === "del").length,
  };
}
