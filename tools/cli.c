/* tools/cli.c — the CLI's shared helpers (cli.h). */
#include <string.h>

#include "cli.h"
#include "../core/path.h"

void cli_put_text(FILE *f, const char *s) {
  char out[6 * 256];
  for (size_t n = strlen(s), i = 0; i < n;) {
    size_t k = dp__name_shown(s + i, n - i, 256);  /* whole characters a piece */
    if (!k) k = n - i < 256 ? n - i : 256;
    dp__sbuf_t b = {out, 0, sizeof out, 0};
    dp__sb_escaped(&b, s + i, k, DP__ESC_CONTROLS, 0);
    fwrite(out, 1, b.len, f);
    i += k;
  }
}
