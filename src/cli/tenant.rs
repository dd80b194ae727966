//! `confed tenant`: tenants managed directly in a data directory.

use anyhow::{Result, bail};
use clap::Subcommand;
use confed::clock::rfc3339;
use confed::db::NewTenant;
use confed::server;

use super::serve::DataDir;

#[derive(Subcommand)]
pub(crate) enum TenantCommand {
    /// Create a tenant and print its API token (alone, on stdout). The token is not stored.
    Create {
        name: String,
        #[command(flatten)]
        data: DataDir,
        #[arg(long, default_value_t = confed::api::admin::DEFAULT_MAX_ACTIVE_TASKS)]
        max_active_tasks: i64,
        #[arg(long, default_value_t = confed::api::admin::DEFAULT_MAX_REPORT_GOAL)]
        max_report_goal: i64,
        /// Device-hours the tenant's active tasks may plan at once.
        #[arg(long, default_value_t = confed::api::admin::DEFAULT_MAX_DEVICE_HOURS)]
        max_device_hours: i64,
    },
    /// List tenants (never their tokens).
    List {
        #[command(flatten)]
        data: DataDir,
    },
}

pub(super) async fn run(command: TenantCommand) -> Result<()> {
    match command {
        TenantCommand::Create {
            name,
            data,
            max_active_tasks,
            max_report_goal,
            max_device_hours,
        } => {
            let request = confed::api::admin::CreateTenantRequest {
                name,
                max_active_tasks: Some(max_active_tasks),
                max_report_goal: Some(max_report_goal),
                max_device_hours: Some(max_device_hours),
            };
            let new: NewTenant = match request.validate() {
                Ok(new) => new,
                Err(problems) => {
                    let text: Vec<_> = problems
                        .iter()
                        .map(|p| format!("{} {}", p.name, p.reason))
                        .collect();
                    bail!("invalid tenant: {}", text.join("; "));
                }
            };
            let (db, fresh) =
                server::open_data_dir(&data.data_dir, data.database.as_deref()).await?;
            if fresh {
                eprintln!(
                    "no task database in {} yet: created one (confed serve --data-dir {} uses it)",
                    data.data_dir.display(),
                    data.data_dir.display()
                );
            }
            let (tenant, token) = db.create_tenant(&new).await?;
            db.close().await;
            eprintln!(
                "created tenant {} ({}); its token follows, shown only this once",
                tenant.name, tenant.id
            );
            println!("{}", token.as_str());
        }
        TenantCommand::List { data } => {
            // Listing never creates: a mistyped --data-dir would otherwise become a new, empty
            // database (and list nothing, as if the tenants were gone).
            if data.database.is_none() {
                let path = server::database_path(&data.data_dir);
                if !path.exists() {
                    bail!(
                        "no task database at {}: is --data-dir right? (confed serve creates it on its first start)",
                        path.display()
                    );
                }
            }
            let (db, _) = server::open_data_dir(&data.data_dir, data.database.as_deref()).await?;
            for t in db.list_tenants().await? {
                println!(
                    "{}\t{}\tmax_active_tasks={}\tmax_report_goal={}\tmax_device_hours={}\tcreated {}",
                    t.name,
                    t.id,
                    t.max_active_tasks,
                    t.max_report_goal,
                    t.max_device_hours,
                    rfc3339(confed::clock::Millis(t.created_at))
                );
            }
            db.close().await;
        }
    }
    Ok(())
}
