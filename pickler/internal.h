/* pickler/internal.h — what the pickler's files share: the runtime below
 * them, the one probe table, and the value model's layout (the walker reads
 * containers directly, and the reader builds them with the value module's
 * private constructors). */
#ifndef DP_PICKLER_INTERNAL_H
#define DP_PICKLER_INTERNAL_H

#include "../core/internal.h"
#include "devpickle/pickler.h"
#include "devpickle/ptrset.h"
#include "../core/table.h"
#include "../value/gc.h"

#endif
