// Saving a file the API answered (fetched with the bearer token) under the name it gives.

import { h } from "./dom.js";

/** The file name of a Content-Disposition header, or `fallback`. */
export function filenameOf(response, fallback) {
  const header = response.headers.get("Content-Disposition") || "";
  const match = /filename="([^"]+)"/.exec(header);
  return match ? match[1] : fallback;
}

/** Save the body of `response` as a download; resolves to the file name used. */
export async function saveResponse(response, fallback) {
  const blob = await response.blob();
  const name = filenameOf(response, fallback);
  const link = h("a", { href: URL.createObjectURL(blob), download: name, hidden: true });
  document.body.append(link);
  link.click();
  setTimeout(() => {
    URL.revokeObjectURL(link.href);
    link.remove();
  }, 1000);
  return name;
}
