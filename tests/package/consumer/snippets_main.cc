// Links the docs' C++ snippets (each a function the driver wrapped, named in snippets.h, which it writes): every
// call they make must resolve against the installed library. Nothing runs them: they need a daemon and a GPU.
#include "snippets.h"

int main(int argc, char**) {
  if (argc > 1000) RunSnippets();  // referenced, never run
  return 0;
}
