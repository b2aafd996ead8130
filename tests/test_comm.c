#include "tp_test.h"
