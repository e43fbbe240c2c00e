// The site opened from the file system (site/index.html, a file:// address): the search
// runs in a web worker, which browsers do not start for file:// pages, so the box would say
// "Initializing search" forever. Say how to open the site so that search works.
if (location.protocol === "file:") {
  document.addEventListener("DOMContentLoaded", function () {
    var hint = "Search needs the site served: make docs-serve, " +
      "or python -m http.server -d site, then open http://127.0.0.1:8000";
    var meta = document.querySelector(".md-search-result__meta");
    if (meta) meta.textContent = hint;
    var input = document.querySelector(".md-search__input");
    if (input) input.placeholder = "Search (needs make docs-serve)";
  });
}
