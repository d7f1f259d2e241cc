// Runs the docs' C++ snippets (each a function the driver wrapped, named in snippets.h, which it writes) against
// the engramd and checkpoint the driver started (their socket and directory replace the docs' in the snippets): each
// call must resolve against the installed library and each `.value()` must hold one. Without arguments it only links
// them (nothing is run).
#include <cstdio>
#include <type_traits>

#include "snippet_prelude.h"
#include "snippets.h"

int main(int argc, char** argv) {
  if (argc < 2 || std::string_view(argv[1]) != "--run") return 0;
  snippet_names::Init();
  RunSnippets();
  std::printf("%d C++ snippets ran, %d results used\n", SnippetCount(), snippet_names::used);
  return 0;
}
