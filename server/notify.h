/* Service manager protocol: notifications (sd_notify: READY, STOPPING, STATUS, watchdog pings)
 * and socket activation (sd_listen_fds). */
#ifndef MD_NOTIFY_H
#define MD_NOTIFY_H

#include <stdint.h>

/* Send one notification such as "READY=1". No-op without $NOTIFY_SOCKET. Returns 0, or a
 * negative errno (callers may ignore it). */
int md_notify(const char *state);
/* Watchdog interval in microseconds requested by the service manager, 0 if none. */
uint64_t md_notify_watchdog_usec(void);
/* Socket activation: the first socket passed by the service manager ($LISTEN_FDS, for this
 * process by $LISTEN_PID), which must be a listening stream socket. Returns the descriptor
 * (>= 3), 0 when none was passed (bind your own), or -ENOTSOCK when what was passed is not a
 * listening stream socket. *n_fds gets how many were passed. The variables are unset, so
 * children do not inherit them. */
int md_notify_listen_fd(int *n_fds);

#endif
