// A small generic syntax highlighter: comments, strings, numbers and keywords, as escaped HTML.
import { escapeHtml } from "./escape.js";

const KEYWORDS = new Set((
  "and as assert async await break case catch class const continue def default defer del do elif else enum " +
  "except export extends false fn for from func function go if impl import in interface is lambda let loop " +
  "match mod module mut new nil none not null or package pass pub raise return self static struct super switch " +
  "this throw trait true try type typeof var void where while with yield None True False SELECT FROM WHERE " +
  "INSERT UPDATE DELETE JOIN INTO VALUES CREATE TABLE int float bool char double " +
  "long unsigned signed public private protected final override sizeof echo local then fi done esac elseif end"
).split(" "));
const HASH = new Set(["python", "py", "sh", "bash", "shell", "zsh", "console", "ruby", "rb", "yaml", "yml", "toml",
  "perl", "r", "make", "makefile", "dockerfile", "ini", "conf", "powershell", "ps1", "nim", "elixir", "julia"]);
const DASH = new Set(["sql", "lua", "haskell", "hs", "elm", "ada"]);

const STRINGS = String.raw`"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|` + "`(?:[^`\\\\]|\\\\.)*`?";
const NUMBER = String.raw`\b(?:0[xX][\da-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b`;
const WORD = String.raw`[A-Za-z_$][\w$]*`;

function commentPattern(lang) {
  if (HASH.has(lang)) return String.raw`#[^\n]*`;
  if (DASH.has(lang)) return String.raw`--[^\n]*`;
  const slash = String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)`;
  return lang ? slash : `${slash}|#[^\\n]*`;  // unknown language: both styles
}

function tokenPattern(lang) {
  return new RegExp(`(${commentPattern(lang)})|(${STRINGS})|(${NUMBER})|(${WORD})`, "g");
}

/** `code` as HTML with <span class="tok-…"> around comments, strings, numbers and keywords. */
export function highlight(code, lang = "") {
  const pattern = tokenPattern(lang.toLowerCase());
  let out = "";
  let last = 0;
  for (const m of code.matchAll(pattern)) {
    out += escapeHtml(code.slice(last, m.index));
    last = m.index + m[0].length;
    const kind = m[1] ? "com" : m[2] ? "str" : m[3] ? "num" : KEYWORDS.has(m[0]) ? "kw" : "";
    out += kind ? `<span class="tok-${kind}">${escapeHtml(m[0])}</span>` : escapeHtml(m[0]);
  }
  return out + escapeHtml(code.slice(last));
}
