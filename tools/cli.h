/* tools/cli.h — what the CLI's commands share, below all of them: the
 * dispatcher (devpickle.c) calls down into demo, inspect and vjson, and
 * those call only this module (and the library). */
#ifndef DP_TOOLS_CLI_H
#define DP_TOOLS_CLI_H
#include <stdio.h>

/* Exit statuses every command gives (devpickle --help, "exit status"). */
#define EXIT_DATA 1  /* bad data or a runtime failure */
#define EXIT_USAGE 2 /* a usage error */

/* Text from outside (a file name, an argument, a message quoting the input)
 * on stdout or stderr, escaped by the rule for names (docs/FORMAT.md,
 * "Paths"; core/path.h): control characters (C0, DEL, C1) and U+2028/U+2029
 * as \uXXXX, a byte of no UTF-8 character as \ufffd, so that a summary or
 * an error stays one line and no file name can forge one. Text escaped
 * already (a path, a name in a message) passes unchanged. */
void cli_put_text(FILE *f, const char *s);
#endif
