// Server-sent events from a fetch() body: the JSON of each `data:` event, until [DONE].

/** Yield each event's parsed `data` from `body` (a ReadableStream of bytes). */
export async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const data = dataOf(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
        if (data === "[DONE]") return;
        if (data !== null) yield JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function dataOf(event) {
  const lines = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
  return lines.length ? lines.join("\n") : null;  // a comment (": waiting for the model") carries none
}
