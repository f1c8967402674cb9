// A small, safe Markdown renderer for model output. All text is HTML-escaped before any markup
// is added, and the only tags produced are the fixed ones below; links must be http(s).
import { escapeHtml } from "./escape.js";
import { highlight } from "./highlight.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const LINK = /\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;
const CODE_SPAN = /`([^`\n]+)`/g;
const HOLE = /\u0000(\d+)\u0000/g;

/** `src` (Markdown) as HTML that is safe to put in innerHTML. */
export function renderMarkdown(src) {
  return blocks(src.replace(/\r\n?/g, "\n").replace(/\u0000/g, "").split("\n"));
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) i++;
    else if ((m = FENCE.exec(line))) i = codeBlock(lines, i, m, out);
    else if ((m = HEADING.exec(line))) {
      const level = Math.min(m[1].length + 2, 6);  // the page's own h1/h2 stay on top of the outline
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (ITEM.test(line)) i = list(lines, i, out);
    else if (QUOTE.test(line)) i = quote(lines, i, out);
    else i = paragraph(lines, i, out);
  }
  return out.join("");
}

function codeBlock(lines, start, fence, out) {
  const close = new RegExp(`^ {0,3}${fence[1][0]}{${fence[1].length},}\\s*$`);
  let i = start + 1;
  const body = [];
  while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);  // unclosed: runs to the end (streaming)
  const lang = fence[2].toLowerCase();
  const cls = lang ? ` class="lang-${escapeHtml(lang)}"` : "";
  out.push(`<div class="code"><button type="button" class="copy">Copy</button><pre><code${cls}>${highlight(body.join("\n"), lang)}</code></pre></div>`);
  return i + 1;
}

function isBlockStart(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || ITEM.test(line) || QUOTE.test(line);
}

function paragraph(lines, start, out) {
  let i = start;
  const text = [];
  while (i < lines.length && lines[i].trim() && (i === start || !isBlockStart(lines[i]))) text.push(lines[i++].trim());
  out.push(`<p>${text.map(inline).join("<br>")}</p>`);
  return i;
}

function quote(lines, start, out) {
  let i = start;
  const inner = [];
  while (i < lines.length && QUOTE.test(lines[i])) inner.push(QUOTE.exec(lines[i++])[1]);
  out.push(`<blockquote>${blocks(inner)}</blockquote>`);
  return i;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

function list(lines, start, out) {
  const first = ITEM.exec(lines[start]);
  const base = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (!line.trim()) {
      const next = lines.slice(i + 1).find((l) => l.trim());
      const nm = next && ITEM.exec(next);
      if (!nm || nm[1].length < base) break;
      i++;
    } else if (m && m[1].length <= base + 1 && /\d/.test(m[2]) === ordered) {
      items.push([inline(m[3])]);
      i++;
    } else if (m && m[1].length > base + 1 && items.length) {
      const nested = [];
      i = list(lines, i, nested);
      items.at(-1).push(nested.join(""));
    } else if (!m && items.length && (indentOf(line) > base || !isBlockStart(line))) {
      items.at(-1).push(`<br>${inline(line.trim())}`);
      i++;
    } else break;
  }
  const tag = ordered ? "ol" : "ul";
  const startAt = ordered ? parseInt(first[2], 10) : 1;
  const attr = ordered && startAt !== 1 ? ` start="${startAt}"` : "";
  out.push(`<${tag}${attr}>${items.map((parts) => `<li>${parts.join("")}</li>`).join("")}</${tag}>`);
  return i;
}

/** Inline Markdown in one line: code spans, links, bold, italic, strikethrough. */
export function inline(text) {
  const holes = [];
  const hold = (html) => `\u0000${holes.push(html) - 1}\u0000`;
  let s = text.replace(CODE_SPAN, (_, code) => hold(`<code>${escapeHtml(code)}</code>`));
  s = escapeHtml(s);
  // After escaping, a URL holds no quote or angle bracket: it cannot leave the href attribute.
  s = s.replace(LINK, (_, label, url) => hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`));
  const fill = (html) => html.replace(HOLE, (_, n) => holes[Number(n)]);
  return fill(fill(emphasis(s)));  // twice: a link's label may hold a code span
}

function emphasis(s) {
  return s
    .replace(/\*\*(?=\S)(.+?)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)(.+?)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/\*(?=[^\s*])([^*]*?[^\s*])?\*/g, (m, inner) => (inner === undefined ? m : `<em>${inner}</em>`))
    .replace(/(^|[^\w])_(?=[^\s_])(.*?[^\s_])?_(?!\w)/g, (m, pre, inner) => (inner === undefined ? m : `${pre}<em>${inner}</em>`))
    .replace(/~~(?=\S)(.+?)~~/g, "<del>$1</del>");
}
