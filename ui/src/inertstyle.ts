// xterm.js writes part of its CSS at run time into <style> elements it
// creates (the DOM renderer's colours, font and row layout, the
// scrollbar's colours). The page's Content-Security-Policy (style-src
// 'self') refuses inline style elements — Chromium even for one whose
// type is not CSS — so ui/build.mjs points those createElement("style")
// calls of xterm's bundle at inertStyle: the element is a <template>,
// whose text is never rendered nor parsed as CSS, and its text is applied
// through a constructed stylesheet (document.adoptedStyleSheets): the
// CSSOM, which the policy does not govern, like the element.style
// properties xterm sets.
const sheets = new Map<Element, CSSStyleSheet>();

export function inertStyle(doc: Document): HTMLTemplateElement {
  const el = doc.createElement("template");
  el.className = "xterm-style";
  const sheet = new CSSStyleSheet();
  sheets.set(el, sheet);
  new MutationObserver(() => {
    sheet.replaceSync(el.textContent ?? "");
    adopt(doc);
  }).observe(el, { childList: true, characterData: true, subtree: true });
  return el;
}

/** adopt applies the sheets of the elements in the page, and forgets the removed ones (a disposed terminal's). */
export function adopt(doc: Document = document): void {
  const mine = new Set(sheets.values());
  const live: CSSStyleSheet[] = [];
  for (const [el, sheet] of sheets) {
    if (el.isConnected) live.push(sheet);
    else sheets.delete(el);
  }
  doc.adoptedStyleSheets = [...doc.adoptedStyleSheets.filter((s) => !mine.has(s)), ...live];
}
