// Package pgnotify carries the outbox's commit hints between processes
// over PostgreSQL LISTEN/NOTIFY. It implements outbox.Transport. It sits
// between the write and relay steps of write → table → relay →
// publisher: it only shortens latency, the relay's polling stays the
// correctness path.
//
// Without it, a commit in one process wakes only the relay of that
// process. When the bucket it wrote is leased by a relay in another
// process, that relay finds the message at its next poll (one second by
// default). With it, the committing process sends the bucket ids in a
// NOTIFY and the owner reads the bucket at once.
//
//	transport, err := pgnotify.New(pgnotify.Config{
//		DSN:    os.Getenv("OUTBOX_LISTEN_DSN"), // direct or session-mode pool
//		Tables: plugin.Config().Tables,         // derives the channel
//		Logger: logger,
//	})
//	if err != nil { ... }
//	defer transport.Close()
//	bridge, err := outbox.StartHintBridge(ctx, plugin.Notifier(), transport, outbox.HintBridgeConfig{Logger: logger})
//	if err != nil { ... }
//	defer bridge.Stop(shutdownCtx)
//
// # Connections
//
// Listen holds one dedicated connection per process for as long as it
// runs. LISTEN is bound to a database session, so that connection must be
// a real session: direct to PostgreSQL, or through a PgBouncer pool in
// session mode. Through a pool in transaction or statement mode the
// session behind it changes between statements and notifications go
// missing; give Config.DSN a direct address even when the application's
// own pool goes through PgBouncer.
//
// NOTIFY is an ordinary statement and works through any pool. By default
// the transport opens one connection of its own for it (Config.PublishDSN,
// else DSN); set Config.PublishDB to send through the application's pool
// instead.
//
// # Cost
//
//   - one LISTEN connection per process (plus one NOTIFY connection unless
//     PublishDB is set);
//   - one NOTIFY per coalesced batch of commits: the HintBridge sends
//     everything committed while the previous NOTIFY was in flight in one
//     payload, so a busy writer sends far fewer NOTIFYs than it commits;
//   - a ping on the listener after PingInterval (10s) without
//     notifications;
//   - on every relay, one wake-up per notification received, and a
//     discovery query when the listener (re)connects.
//
// A notifying transaction takes a database-wide lock at commit, so
// concurrent NOTIFYs are serialised. The transport sends NOTIFY in its own
// short transaction after the business commit, never inside it, so
// business commits never wait on that lock, and the HintBridge keeps at
// most one NOTIFY in flight per process. That transaction commits with
// synchronous_commit off (for itself only), so it does not wait for a WAL
// flush: a notification lost in a crash is a hint lost, which the poll
// and the listeners' rediscovery cover.
//
// # Semantics
//
// Hints are advisory and polling stays on. A NOTIFY can be lost (the
// listener was reconnecting, the notification queue overflowed), and then
// the relay finds the message at its next poll. After every (re)connection
// the listener delivers outbox.UnknownBucket, so relays run a discovery
// query at once and do not wait for the poll to cover the gap. Duplicate
// and reordered hints cost at most an extra query.
//
// Each Transport tags its payloads with a random sender id and skips its
// own echoes; the HintBridge never republishes what it received either.
// The payload is a short text, "h1:<sender>:<ids>", with the ids as a
// decimal list or a base64 bitmap, whichever is shorter: all 4096 buckets
// fit in well under the 8000-byte NOTIFY limit.
//
// # Channels
//
// All processes of one outbox table must share a channel, and each table
// (and each environment that shares a database) needs its own. The
// default, DefaultChannel(Config.Tables), is derived from the schema and
// the messages table; outboxes that differ only by search_path need
// explicit channels.
package pgnotify
