/* tools/demo.h — `devpickle demo`. */
#ifndef DP_TOOLS_DEMO_H
#define DP_TOOLS_DEMO_H
#include "devpickle.h"
int demo_run(int argc, char **argv);
#endif
