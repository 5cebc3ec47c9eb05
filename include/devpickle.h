/* devpickle.h — the whole public API. */
#ifndef DEVPICKLE_H
#define DEVPICKLE_H
#include "devpickle/base.h"
#include "devpickle/value.h"
#include "devpickle/ptrset.h"
#include "devpickle/pickler.h"
#include "devpickle/device.h"
#include "devpickle/cache.h"
#include "devpickle/future.h"
#endif
