/* tools/demo.h — `devpickle demo`. */
#ifndef DP_TOOLS_DEMO_H
#define DP_TOOLS_DEMO_H
#include <stdio.h>
#include "devpickle.h"
int demo_run(int argc, char **argv);
int demo_err(dp_error_t *err, int code, const char *msg);
/* devpickle.c: text from outside (an argument, a file name) written for a
 * terminal, escaped as names are (docs/FORMAT.md, "Paths"). */
void cli_put_text(FILE *f, const char *s);
#endif
