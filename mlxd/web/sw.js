// mlxd's service worker: the page's shell (`/` and `/ui/*`) for installing the page as an app
// and opening it while mlxd is down; never API traffic. Each shell file comes from the network
// first (an upgraded mlxd is never hidden behind a stale copy) and is kept for when the network
// fails. Every other request (the APIs, /admin, /health, /metrics) is not intercepted at all.
const CACHE = "mlxd-shell-1";

function isShell(url) {
  return url.origin === self.location.origin && (url.pathname === "/" || url.pathname.startsWith("/ui/"));
}

self.addEventListener("install", (event) => {
  event.waitUntil(caches.open(CACHE).then((cache) => cache.add("/")).then(() => self.skipWaiting()));
});

self.addEventListener("activate", (event) => {
  event.waitUntil(caches.keys()
    .then((names) => Promise.all(names.filter((n) => n !== CACHE).map((n) => caches.delete(n))))
    .then(() => self.clients.claim()));
});

self.addEventListener("fetch", (event) => {
  const request = event.request;
  if (request.method !== "GET" || !isShell(new URL(request.url))) return;  // the network's, untouched
  event.respondWith(fetch(request).then((response) => {
    if (response.ok) {
      const copy = response.clone();
      event.waitUntil(caches.open(CACHE).then((cache) => cache.put(request, copy)));
    }
    return response;
  }, async () => (await caches.match(request, { ignoreSearch: true }))
    ?? new Response("mlxd is not reachable, and this file was never loaded here.", {
      status: 503, headers: { "Content-Type": "text/plain" } })));
});
