/* Service manager notifications (sd_notify): READY, STOPPING, STATUS and watchdog pings. */
#ifndef MD_NOTIFY_H
#define MD_NOTIFY_H

#include <stdint.h>

/* Send one notification such as "READY=1". No-op without $NOTIFY_SOCKET. Returns 0, or a
 * negative errno (callers may ignore it). */
int md_notify(const char *state);
/* Watchdog interval in microseconds requested by the service manager, 0 if none. */
uint64_t md_notify_watchdog_usec(void);

#endif
