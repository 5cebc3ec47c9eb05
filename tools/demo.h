/* tools/demo.h — `devpickle demo`. */
#ifndef DP_TOOLS_DEMO_H
#define DP_TOOLS_DEMO_H
int demo_run(int argc, char **argv);
#endif
