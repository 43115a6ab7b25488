package pgwal

import (
	"context"
	"fmt"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/gorm-outbox/outbox/relay"
)

// failoverMinVersion is the first server_version_num with failover slots.
const failoverMinVersion = 170000

// prepareSlot runs before the slot is read or created: the bridge's
// publication (Config.Bridge) and the failover option (Config.FailoverSlot).
func (r *Reader) prepareSlot(ctx context.Context) error {
	if err := r.syncBridge(ctx); err != nil {
		return err
	}
	return r.ensureFailover(ctx)
}

// ensureFailover refuses Config.FailoverSlot on a server before
// PostgreSQL 17, and turns the option on for an existing slot that lacks
// it.
func (r *Reader) ensureFailover(ctx context.Context) error {
	if !r.cfg.FailoverSlot {
		return nil
	}
	var version int
	if err := r.sess(ctx).Raw("SELECT current_setting('server_version_num')::int").Scan(&version).Error; err != nil {
		return fmt.Errorf("pgwal: read the server version: %w", err)
	}
	if version < failoverMinVersion {
		return &relay.ConfigError{Package: "pgwal", Field: "FailoverSlot", Value: true,
			Reason: fmt.Sprintf("failover slots need PostgreSQL 17 or later; the server's server_version_num is %d", version)}
	}
	var off int64
	if err := r.sess(ctx).Raw("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ? AND NOT failover AND database = current_database()", r.cfg.Slot).Scan(&off).Error; err != nil {
		return fmt.Errorf("pgwal: read slot %s: %w", r.cfg.Slot, err)
	}
	if off == 0 {
		return nil
	}
	conn, err := r.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "ALTER_REPLICATION_SLOT "+r.cfg.Slot+" (FAILOVER true)").ReadAll(); err != nil {
		return fmt.Errorf("pgwal: make slot %s a failover slot: %w", r.cfg.Slot, err)
	}
	r.log.Info("pgwal: the slot is now a failover slot")
	return nil
}

// createFailoverSlot creates the slot with the FAILOVER option
// (PostgreSQL 17+) on the replication connection conn and returns its
// consistent point.
func (r *Reader) createFailoverSlot(ctx context.Context, conn *pgconn.PgConn) (pglogrepl.LSN, error) {
	res, err := conn.Exec(ctx, "CREATE_REPLICATION_SLOT "+r.cfg.Slot+" LOGICAL pgoutput (FAILOVER true)").ReadAll()
	if err != nil {
		return 0, fmt.Errorf("pgwal: create failover slot %s: %w", r.cfg.Slot, err)
	}
	if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) < 2 {
		return 0, fmt.Errorf("pgwal: create failover slot %s: unexpected result", r.cfg.Slot)
	}
	return pglogrepl.ParseLSN(string(res[0].Rows[0][1]))
}
