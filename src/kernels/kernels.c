/* The parts of the kernel interface (kernels.h) every build has: op names
 * and the errors the tables answer with. */
#include "core/core.h"
#include "kernels/kernels.h"

#define TP__KOP_NAME(NAME, field) [TP__KOP_##NAME] = #field,
static const char *const kop_names[TP__KOP_COUNT] = {TP__KERNEL_ENTRIES(TP__KOP_NAME)};
#undef TP__KOP_NAME

/* every op of the enum has an entry */
#define TP__KOP_ONE(NAME, field) +1
_Static_assert(0 TP__KERNEL_ENTRIES(TP__KOP_ONE) == TP__KOP_COUNT - 1,
               "TP__KERNEL_ENTRIES and tp__kop disagree");
#undef TP__KOP_ONE

const char *tp__kop_name(tp__kop op)
{
    const char *s = op > TP__KOP_NONE && op < TP__KOP_COUNT ? kop_names[op] : NULL;
    return s ? s : "?";
}

tp_status tp__kernels_unsupported(const tp__kernels *k, tp__kop op, tp_dtype dtype)
{
    return tp__error(TP_ERR_NOT_SUPPORTED, "%s kernels: %s does not take %s", k->name,
                     tp__kop_name(op), tp_dtype_name(dtype));
}

tp_status tp__kernels_missing(tp_device dev)
{
    if (dev.type == TP_DEVICE_CUDA)
        return tp__error(TP_ERR_NOT_SUPPORTED, "no kernels for cuda:%d: libtp was built without "
                         "CUDA", dev.index);
    return tp__error(TP_ERR_NOT_SUPPORTED, "no kernels for device type %d", (int)dev.type);
}
