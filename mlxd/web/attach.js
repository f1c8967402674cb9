// Images attached to the next chat message: by the file picker, pasted, or dropped on the composer.
// Each is read as a data: URI (the request carries it; nothing is uploaded anywhere else) and shown
// as a thumbnail with a button that takes it off again.
import { announce, el } from "./page.js";

const MAX_BYTES = 20 * 1024 * 1024;  // the server's limit for one image
const pending = [];  // {name, url}, in the order attached (url null while it is read)
const $ = (id) => document.getElementById(id);

export function wireAttach() {
  $("chat-attach").addEventListener("click", () => $("chat-file").click());
  $("chat-file").addEventListener("change", (ev) => { addFiles(ev.target.files); ev.target.value = ""; });
  $("chat-prompt").addEventListener("paste", (ev) => {
    const files = [...(ev.clipboardData?.files ?? [])].filter((f) => f.type.startsWith("image/"));
    if (files.length) { ev.preventDefault(); addFiles(files); }
  });
  const form = $("chat-form");
  form.addEventListener("dragover", (ev) => { if (hasFiles(ev)) { ev.preventDefault(); form.classList.add("dropping"); } });
  form.addEventListener("dragleave", () => form.classList.remove("dropping"));
  form.addEventListener("drop", (ev) => {
    form.classList.remove("dropping");
    if (!hasFiles(ev)) return;
    ev.preventDefault();
    addFiles(ev.dataTransfer.files);
  });
}

function hasFiles(ev) {
  return [...(ev.dataTransfer?.types ?? [])].includes("Files");
}

async function addFiles(files) {
  // Each image takes its place in the list now, in the order it came, and shows once read: a
  // drop right after a pick must not pass it while the pick is still being read.
  const reads = [];
  for (const file of files) {
    if (!file.type.startsWith("image/")) { announce(`${file.name} is not an image.`, "error"); continue; }
    if (file.size > MAX_BYTES) { announce(`${file.name} is over 20 MB.`, "error"); continue; }
    const image = { name: file.name || "pasted image", url: null };
    pending.push(image);
    reads.push(readAsDataUrl(file).then((url) => { image.url = url; }, () => {
      pending.splice(pending.indexOf(image), 1);
      announce(`${image.name} could not be read.`, "error");
    }));
  }
  await Promise.all(reads);
  render();
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function render() {
  const list = $("chat-attachments");
  const ready = pending.filter((image) => image.url !== null);
  list.hidden = ready.length === 0;
  list.replaceChildren(...ready.map((image) => {
    const item = el("li", "attachment");
    const img = el("img");
    img.src = image.url;
    img.alt = image.name;
    const remove = el("button", "quiet", "×");
    remove.type = "button";
    remove.setAttribute("aria-label", `Remove ${image.name}`);
    remove.addEventListener("click", () => { pending.splice(pending.indexOf(image), 1); render(); });
    item.append(img, remove);
    return item;
  }));
}

/** The images attached to the next message. */
export function attachments() {
  return pending.filter((image) => image.url !== null);
}

/** Empty the list (the message with them was sent). */
export function clearAttachments() {
  pending.splice(0);
  render();
}

/** A message's content: the text alone, or its text and images as OpenAI content parts. */
export function messageContent(text, images) {
  if (!images.length) return text;
  return [...images.map((image) => ({ type: "image_url", image_url: { url: image.url } })),
    ...(text ? [{ type: "text", text }] : [])];
}

/** The user's message in the transcript: its images, then its text. */
export function imagesView(images) {
  const row = el("div", "images");
  for (const image of images) {
    const img = el("img");
    img.src = image.url;
    img.alt = image.name;
    row.append(img);
  }
  return row;
}
